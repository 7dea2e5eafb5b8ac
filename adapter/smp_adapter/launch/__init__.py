"""Starting the ranks of a job and how a rank finds its world. command.py: a job -> the launcher's
command line (pure); inputs.py: what ``launch`` was asked to run; supervisor.py: runs and watches the
ranks; rank_env.py: inside a rank, who launched it and where the ranks meet. Nothing here imports
torch at import time: the launch processes and ``smdistributed.modelparallel``'s import use it."""
