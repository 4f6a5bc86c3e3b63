"""What every tokenizer family offers: Meta's interface, plus the ids that end a generation
and the family's chat prompt."""

from . import chat_format


class Tokenizer:
    """encode(text, bos=True, eos=False) -> ids and decode(ids) -> text, with Meta's attributes:
    bos_id, eos_id, pad_id (-1: none), n_words and model_path (the file it was read from)."""

    model_path: str
    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int
    dummy_prefix = False  # SentencePiece's families put a space before the text they encode

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self) -> list[bytes]:
        """The text each id stands for in a decoded text, as UTF-8 bytes (b"" for BOS, EOS and
        other control tokens): what bits per byte counts. With a dummy prefix, the first
        token of a text stands for one byte less than its piece."""
        raise NotImplementedError

    @property
    def stop_ids(self) -> list[int]:
        """The ids that end a generation: Llama-2 has one, its EOS."""
        return [self.eos_id]

    def encode_dialog(self, dialog: list[dict]) -> list[int]:
        """The prompt ids of Meta's chat_completion for a list of {"role", "content"} turns."""
        return chat_format.llama2_dialog(self, dialog)
