"""What the layers share: the command lines' one error path and flag checks (cli.py), writing
files atomically (files.py), the device and dtypes (device.py), memory checked before it is
allocated (memory.py), bits per byte (bits_per_byte.py) and GGUF's container, read trusting
nothing (gguf_file.py, for formats/ and tokenizers/ alike)."""
