"""SentencePiece tokenizer: Meta's Llama-2 tokenizer.model, or a small BPE trained on our data."""

import io
import os
from typing import Iterable

import sentencepiece as spm

# Meta's chat markup (llama/generation.py).
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


class Tokenizer:
    def __init__(self, model_path):
        model_path = os.fspath(model_path)
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer not found: {model_path}; pass --tokenizer PATH/tokenizer.model")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{model_path} is not a SentencePiece model ({e})") from None
        self.n_words: int = self.sp.vocab_size()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()  # -1 in Meta's tokenizer: there is no pad token

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids))

    def encode_dialog(self, dialog: list[dict]) -> list[int]:
        """The prompt ids of Meta's chat_completion for a list of {"role", "content"} turns.

        An optional leading system message is folded into the first user turn inside
        <<SYS>> tags; each finished exchange is BOS [INST] user [/INST] answer EOS, and the
        last user turn is left open for the model to answer.
        """
        if any(tag in turn["content"] for turn in dialog for tag in (B_INST, E_INST, "<<SYS>>", "<</SYS>>")):
            raise ValueError("dialog content must not contain the chat markup [INST], [/INST], <<SYS>> or <</SYS>>")
        if dialog and dialog[0]["role"] == "system":
            if len(dialog) < 2:
                raise ValueError("a system message must be followed by a user message")
            first = {"role": dialog[1]["role"], "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}
            dialog = [first] + dialog[2:]
        roles = [turn["role"] for turn in dialog]
        if len(dialog) % 2 == 0 or roles[::2] != ["user"] * len(roles[::2]) or roles[1::2] != ["assistant"] * len(roles[1::2]):
            raise ValueError("dialog turns must alternate user/assistant, starting and ending with user")
        ids = []
        for prompt, answer in zip(dialog[::2], dialog[1::2]):
            text = f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} "
            ids += self.encode(text, bos=True, eos=True)
        return ids + self.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", bos=True, eos=False)

    @classmethod
    def train(cls, lines: Iterable[str], vocab_size: int, model_path) -> "Tokenizer":
        """Train a BPE tokenizer with byte fallback, Llama-style (no normalisation, digits
        split, unk/bos/eos = 0/1/2), write it to model_path and load it.

        Byte fallback means any UTF-8 text round-trips, even characters never seen in training.
        """
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            split_digits=True,
            character_coverage=1.0,
            allow_whitespace_only_pieces=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            max_sentence_length=1 << 16,
            input_sentence_size=200_000,
            shuffle_input_sentence=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        tmp = f"{model_path}.tmp"
        with open(tmp, "wb") as f:
            f.write(model.getvalue())
        os.replace(tmp, model_path)
        return cls(model_path)
