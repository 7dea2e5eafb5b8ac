"""Checkpoint integrity: a damaged checkpoint is refused, naming the file, before any value is used.

* ``manifest.py``: the manifest a partial checkpoint's folder carries (each file's size and digest, its
  own digest); ``verify`` and the agreement of the ranks on problems;
* ``saving.py``: the save's digests (hashed as written, gathered, the manifest written last);
* ``resume_check.py``: the resume's check, in two collective halves around the engine's load (files
  hashed as torch.load reads them);
* ``records.py``: file digests (xxh3_128 or blake2b, per chunk); ``hashing_io.py``: hashing writers and readers;
* ``spare_cores.py``: hashing beside a load or save on the cores a rank does not use;
* ``sidecars.py``: ``<file>.smp_digest`` beside single files (full checkpoints, ``smp.save``).
"""
