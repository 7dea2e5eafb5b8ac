"""``smp-adapter check``: the static script check (parses a script, never runs it). script.py: the walk
and the verdict; api.py: what the runtime provides, read from the runtime; local.py: the script's own
modules and its missing imports; apex_names.py: apex names, real or fallback."""
