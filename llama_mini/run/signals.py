"""Ctrl-C and SIGTERM as a request to stop after the current step, so the checkpoint saved
then is consistent. SIGTERM is how torchrun and job schedulers stop a run; a second Ctrl-C
interrupts at once."""

import signal
import threading


class GracefulStop:
    """While entered, the first SIGINT or SIGTERM sets .requested instead of interrupting."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            self.previous = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}
