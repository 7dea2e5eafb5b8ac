"""The directory smp-adapter launch puts on PYTHONPATH (sitecustomize.py)."""
