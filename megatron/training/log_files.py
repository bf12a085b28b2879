"""Files the trainer writes beside its console output, under --log-path.

The console keeps what a user follows; long listings (the arguments, the model's layers and
pipeline partition) go to a file named ``{stem}_{YYYYmmdd-HHMMSS}.txt`` and the console gets one
line naming it. Each file is written under a temporary name and renamed when complete.
"""
import os
import tempfile
import time


def write_log_file(directory: str, stem: str, text: str) -> str:
    """Write ``text`` to ``directory``/``stem``_<YYYYmmdd-HHMMSS>.txt atomically; return the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}.txt")
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=f".{stem}_", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)
    return path
