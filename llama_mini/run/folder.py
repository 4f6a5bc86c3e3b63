"""A training run's folder: what it holds, how it is written, and what the run may delete.

    run.json          marks the folder as a run of ours (its format record) and lists the checkpoints it wrote
    train.lock        one writer at a time (lock.py)
    tokenizer.model   the run's own copy of its tokenizer
    metrics.jsonl     one JSON record per step
    step-NNNNNN/      a checkpoint: load_checkpoint's native folder plus train_state.pt
    latest            the name of the newest complete checkpoint
    loss.png          the loss curves, at the end

The folder is the run's own, and the run touches nothing else in it. A new run starts only
in a missing or empty folder, or in one a run of ours left before its first checkpoint.
Pruning deletes only checkpoints that run.json lists, the lowest step numbers first, and
never the one `latest` names. A checkpoint is written under a temporary name and renamed
into place before `latest` moves to it, so a kill at any moment leaves `latest` naming a
complete checkpoint.
"""

import dataclasses
import filecmp
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

from ..support.cli import flag
from ..support.files import atomic_folder, atomic_write, torch_save
from ..formats.checkpoint import save_checkpoint
from ..formats.native import CHECKPOINT_NAME, LATEST, TOKENIZER, checkpoint_name, read_latest, step_of
from ..formats.record import check_run_record, format_record
from ..formats.state_dict import build_model
from ..model import ModelArgs
from ..tokenizers import copy_tokenizer
from .config import MODEL_SHAPE
from .lock import LOCK_NAME, RunFolderBusy, RunLock
from .plots import Curve, plot_curves

RUN_RECORD, TRAIN_STATE, METRICS = "run.json", "train_state.pt", "metrics.jsonl"

# Settings a resumed run must share with its checkpoint: they fix the model and the data it
# sees and how it steps (under --fsdp, the optimizer state is keyed by parameter name, not position).
RESUME_MUST_MATCH = (*MODEL_SHAPE, "tokenizer", "seq_len", "val_fraction", "fsdp", "optimizer", "lr_schedule",
                     "flush_denormals")


class RunFolder:
    """The run folder of one run. Constructing it only checks (a new run needs a folder it
    may write in, a resumed one a complete checkpoint); open() takes it."""

    def __init__(self, path, resume: bool):
        self.path = Path(path)
        self.lock: Optional[RunLock] = None
        self.checkpoints: list[str] = []  # the checkpoints this run wrote, by name
        self.latest: Optional[Path] = None
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"the run folder {self.path} is a file; pass --out a folder")
        if resume:
            self.latest = self.find_latest()
            self.checkpoints = self.read_record()
            read_metrics(self.path / METRICS)  # refused now, before the folder is taken
        else:
            self.check_new()

    def check_new(self) -> None:
        if (self.path / LATEST).is_file():
            raise ValueError(
                f"{self.path} already holds a training run; pass --resume to continue it, or --out DIR for a new run"
            )
        if (self.path / RUN_RECORD).is_file():  # a run of ours that stopped before its first checkpoint
            self.checkpoints = self.read_record()
            return
        theirs = sorted(p.name for p in self.path.iterdir() if p.name != LOCK_NAME) if self.path.is_dir() else []
        if theirs:
            listed = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            raise ValueError(
                f"{self.path} is not empty ({listed}) and holds no training run; a run writes only into "
                "a new or empty folder: pass --out a new folder"
            )

    def find_latest(self) -> Path:
        """The checkpoint `latest` names, which must be one of this folder's own step-N folders."""
        try:
            latest = read_latest(self.path)
        except ValueError as e:
            raise ValueError(f"cannot --resume: {e}") from None
        if latest is None:
            raise ValueError(
                f"nothing to resume: {self.path} holds no checkpoint ({LATEST} is missing); run without --resume to start"
            )
        return latest

    def read_record(self) -> list[str]:
        """The checkpoints run.json lists, once its format record says this version reads it."""
        file = self.path / RUN_RECORD
        if not file.exists():
            check_run_record(None, file, self.latest)  # refuses a run folder from before run.json
        try:
            if file.stat().st_size > 1 << 20:  # a record lists a few names; this is not ours
                raise ValueError("too large")
            fields = json.loads(file.read_text())
            names = fields["checkpoints"]  # TypeError where run.json holds no object
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{file} is corrupt ({type(e).__name__}); it lists the run's checkpoints") from None
        check_run_record(fields, file, self.latest)
        if not isinstance(names, list) or not all(isinstance(n, str) and CHECKPOINT_NAME.fullmatch(n) for n in names):
            raise ValueError(f"{file} lists names that are not step-N checkpoints of this run")
        return names

    def write_record(self) -> None:
        record = {**format_record(), "checkpoints": self.checkpoints}
        atomic_write(self.path / RUN_RECORD, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))

    # -- resuming --

    def read_state(self) -> dict:
        """The training state of the latest checkpoint, checked field by field: resuming from a
        state that is not whole would restart the run and prune the checkpoints it should keep."""
        file = self.latest / TRAIN_STATE
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"cannot --resume: {file} is missing; not a training checkpoint") from None
        except Exception as e:  # a torn or foreign file: refuse it by name
            raise ValueError(f"cannot --resume: {file} is corrupt ({type(e).__name__})") from None
        problem = state_problem(state, step_of(self.latest.name))
        if problem:
            raise ValueError(f"cannot --resume: {file} is not a training state of this run ({problem}); "
                             f"point {LATEST} at an earlier checkpoint, or start a new --out")
        return state

    def resumed_config(self, cfg, saved: dict):
        """cfg with the model shape it leaves open (None) taken from the run; refuses a flag that
        disagrees with what the run was trained with."""
        then, now = saved["config"], dataclasses.asdict(cfg)
        diffs = [f"{flag(k)} {then.get(k)} (now {now[k]})" for k in RESUME_MUST_MATCH
                 if now[k] is not None and then.get(k) != now[k]]
        if diffs:
            raise ValueError(
                f"cannot --resume {self.path}: it was trained with {', '.join(diffs)}; "
                "pass the flags it was trained with, or a new --out to start another run"
            )
        taken = {k: then[k] for k in RESUME_MUST_MATCH if now[k] is None and k in then}
        # what a run from before a field existed was trained with: the field's default then
        before = {f.name: f.metadata["fresh"] for f in dataclasses.fields(cfg) if "fresh" in f.metadata and f.name not in then}
        return dataclasses.replace(cfg, **before, **taken)

    # -- writing --

    def open(self, tokenizer_path) -> None:
        """Take the folder: lock it, mark it as ours, copy the tokenizer in, clear what a crash
        left. If this fails in a folder it created, nothing is left behind."""
        created = next((p for p in reversed([self.path, *self.path.parents]) if not p.exists()), None)
        try:
            self.lock = RunLock(self.path).acquire()
            for name in self.checkpoints:  # a checkpoint a crash left half-written
                shutil.rmtree(self.path / f".tmp-{name}", ignore_errors=True)
            self.write_record()
            # The run's own copy of its tokenizer, which every checkpoint copies: the file it was
            # loaded from may be a checkpoint that gets pruned, or a cache someone clears.
            ours = self.path / TOKENIZER
            if not (ours.is_file() and filecmp.cmp(tokenizer_path, ours, shallow=False)):
                atomic_write(ours, lambda tmp: copy_tokenizer(tokenizer_path, tmp))  # of a GGUF model, its vocabulary
        except BaseException as e:
            self.close()
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, RunFolderBusy):
                raise OSError(f"cannot write to the run folder {self.path}: {e.strerror or e}") from None
            raise

    def save(self, step: int, args: ModelArgs, state: dict, meta: dict, keep: int) -> Path:
        """Write checkpoint step-N: the weights state["model"] as load_checkpoint reads them, the
        rest of state and meta as train_state.pt. Then `latest` names it, and all but the newest
        keep checkpoints of this run are deleted."""
        name = checkpoint_name(step)
        folder, tmp = self.path / name, self.path / f".tmp-{name}"
        if name not in self.checkpoints:
            if folder.exists() or tmp.exists():
                raise OSError(f"cannot save {folder}: it exists and this run did not write it; move it out of {self.path}")
            self.checkpoints.append(name)
            self.write_record()  # before any of it exists: a crash leaves nothing the record does not name
        shutil.rmtree(tmp, ignore_errors=True)  # ours, left by a run killed while writing it
        train_state = {**{k: v for k, v in state.items() if k != "model"}, **meta}

        def write(tmp):
            save_checkpoint(build_model(args, state["model"]), tmp, tokenizer_path=self.path / TOKENIZER)
            atomic_write(tmp / TRAIN_STATE, lambda path: torch_save(train_state, path))

        try:  # a folder of ours at this step, left by a run killed before `latest` named it, is replaced
            atomic_folder(folder, write, tmp=tmp, replacing=True)
        except OSError as e:  # a full disk, say: no half-written folder is left behind
            reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
            if self.latest:
                then = f"{LATEST} still names {self.latest.name}. Free some space and --resume"
            else:  # --resume would find nothing to resume
                then = "no checkpoint was saved. Free some space and run the same command again (there is no checkpoint to --resume)"
            raise OSError(f"cannot save {folder}: {reason}; {then}") from None
        atomic_write(self.path / LATEST, lambda path: path.write_text(name + "\n"))
        self.latest = folder
        self.prune(keep)
        return folder

    def prune(self, keep: int) -> None:
        """Delete this run's checkpoints but the newest keep, by step number; never `latest`'s."""
        mine = sorted((n for n in self.checkpoints if (self.path / n).is_dir()), key=step_of)
        stale = [n for n in mine[:-keep] if self.path / n != self.latest]
        for name in stale:
            shutil.rmtree(self.path / name, ignore_errors=True)
        self.checkpoints = [n for n in mine if n not in stale]
        self.write_record()

    def close(self) -> None:
        if self.lock:
            self.lock.release()
            self.lock = None


# What train_state.pt holds (TrainingRun.state_dict without the model, and the run's config), by type.
STATE_FIELDS = {"optimizer": dict, "step": int, "elapsed": (int, float), "data_rng": torch.Tensor,
                "torch_rng": torch.Tensor, "cuda_rng": list, "python_rng": tuple, "config": dict, "data_digest": str}


def state_problem(state, step: int) -> Optional[str]:
    """What is wrong with a loaded train_state.pt of checkpoint step-<step>, or None."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict"
    missing = [k for k in STATE_FIELDS if k not in state]
    if missing:
        return f"{', '.join(missing)} missing"
    wrong = [k for k, kind in STATE_FIELDS.items() if not isinstance(state[k], kind) or isinstance(state[k], bool)]
    if wrong:
        return f"{', '.join(wrong)} of the wrong type"
    if state["step"] != step:
        return f"it says step {state['step']}, in the folder of step {step}"
    return None


# --- The metrics log -----------------------------------------------------------------------------


class MetricsLog:
    """<run>/metrics.jsonl, one JSON object per step. On resume the records past the
    checkpoint's step (written before a crash) are dropped, so the log tells one history."""

    def __init__(self, path: Path, step: int):
        self.path = path
        kept = [r for r in read_metrics(path, notify=True) if r["step"] <= step] if step else []
        atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path, notify: bool = False) -> list[dict]:
    """The records of a metrics log, each an object with an integer step. A torn last line is
    what a crash mid-write leaves: it is dropped (with a notice, if notify). Any other line that
    is not a record is refused in one line naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the metrics log {path}: {getattr(e, 'strerror', None) or e}") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] >= 0:
            records.append(record)
        elif number == len(lines):  # no newline after it: a write the crash cut short
            if notify:
                print(f"{path}: dropped its last line, cut short by a crash", file=sys.stderr)
        else:
            raise ValueError(f"{path} line {number} is not a metrics record of this run (a JSON object with a step); "
                             "remove that line to resume")
    return records


def report_losses(run_dir: Path) -> None:
    """loss.png in the run folder when matplotlib is installed; a table of evaluations otherwise."""
    records = read_metrics(run_dir / METRICS)
    trained, evals = [r for r in records if "train_loss" in r], [r for r in records if "val_loss" in r]
    curves = [Curve("train", [r["step"] for r in trained], [r["train_loss"] for r in trained], faint=True),
              Curve("val", [r["step"] for r in evals], [r["val_loss"] for r in evals], style="o-")]
    if plot_curves(run_dir / "loss.png", curves, "step", "cross-entropy loss (nats per token)", run_dir.name):
        print(f"loss curve: {run_dir / 'loss.png'}")
        return
    print("step   train loss   val loss   val bits/byte   val ppl   (pip install matplotlib for loss.png)")
    train_loss = {r["step"]: r["train_loss"] for r in trained}
    for r in evals:
        print(f"{r['step']:>5}   {train_loss.get(r['step'], math.nan):>10.4f}   {r['val_loss']:>8.4f}   "
              f"{r.get('val_bpb', math.nan):>13.4f}   {r['val_ppl']:>7.2f}")
