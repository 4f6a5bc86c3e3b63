"""A checkpoint made ready to run for the command lines: the flags and loading generate.py and
evaluate share (loading.py), and generate.py's chat (chat.py)."""
