"""Checkpoints, one capability in one folder (docs/checkpoints.md).

* ``save_load.py``: ``smp.save`` / ``smp.load`` and the model state-dict helpers behind DistributedModel;
* ``dirs.py``: ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: tags, ``newest``, retention, and
  the resume's check around the engine's load;
* ``io.py``: ``CheckpointIO``, the one object a partial checkpoint's engine writes and reads through;
* ``files.py``: atomic writes, safe loads, the layout a checkpoint records;
* ``universal.py``, ``refs.py``: the layout-independent pieces (a job of another layout resumes from them);
* ``integrity/``: what makes a damaged checkpoint refused, not loaded (manifest, the save's digests, the
  resume's check, sidecars).
"""
