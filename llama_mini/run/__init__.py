"""A training run's machinery, around the training step (llama_mini/trainer.py) and loop (train.py).

config.py        TrainConfig: every flag, described once
start.py         a run set up from its TrainConfig: new, resumed or fine-tuning
training_run.py  the run around its Trainer: evaluation, samples, checkpoints and exact resume
data.py          text in, token windows out (corpus.py: the built-in stories)
folder.py        the run's folder: checkpoints, resume, pruning, metrics (lock.py: one writer)
signals.py       Ctrl-C and SIGTERM as a request to stop after the step
distributed.py   K processes under torchrun: DDP or FSDP2
plots.py         loss curves (train.py's report and the ablation, llama_mini/ablate.py)
"""
