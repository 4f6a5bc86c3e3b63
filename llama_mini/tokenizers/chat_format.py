"""Meta's chat prompts: how a dialog of {"role", "content"} turns becomes the ids a chat model reads.

Llama-2 (llama/generation.py, chat_completion) marks turns with text, [INST] ... [/INST], and
each exchange with BOS ... EOS. Llama-3 (llama3/tokenizer.py, ChatFormat.encode_dialog_prompt)
marks them with special tokens that text cannot spell: a header per message and <|eot_id|> after it.
"""

# Meta's Llama-2 chat markup (llama/generation.py).
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"

LLAMA3_ROLES = ("system", "user", "assistant", "ipython")  # ipython: a tool's output (Llama-3.1)


def llama2_dialog(tokenizer, dialog: list[dict]) -> list[int]:
    """The prompt ids of Meta's Llama-2 chat_completion.

    An optional leading system message is folded into the first user turn inside <<SYS>>
    tags; each finished exchange is BOS [INST] user [/INST] answer EOS, and the last user
    turn is left open for the model to answer.
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
        ids += tokenizer.encode(text, bos=True, eos=True)
    return ids + tokenizer.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", bos=True, eos=False)


def llama3_dialog(tokenizer, dialog: list[dict]) -> list[int]:
    """The prompt ids of Meta's Llama-3 ChatFormat.encode_dialog_prompt.

    BOS, then per message <|start_header_id|>role<|end_header_id|>"\\n\\n" content <|eot_id|>,
    then an open assistant header for the model to complete. Content is plain text: a
    "<|eot_id|>" typed by a user is encoded as its characters, not as the token.
    """
    special = tokenizer.special_tokens
    unknown = sorted({turn["role"] for turn in dialog} - set(LLAMA3_ROLES))
    if unknown:
        raise ValueError(f"unknown dialog role(s) {unknown}; Llama-3 knows {', '.join(LLAMA3_ROLES)}")

    def header(role):
        text = tokenizer.encode(role, bos=False)
        return [special["<|start_header_id|>"], *text, special["<|end_header_id|>"], *tokenizer.encode("\n\n", bos=False)]

    ids = [tokenizer.bos_id]
    for turn in dialog:
        ids += header(turn["role"]) + tokenizer.encode(turn["content"].strip(), bos=False) + [special["<|eot_id|>"]]
    return ids + header("assistant")
