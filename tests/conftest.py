import os

# DeepSpeed picks its accelerator at import time; tests run on CPU unless a test says otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
