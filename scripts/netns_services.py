"""``netns_cluster.py --slurm`` / ``--ssh``: Slurm's daemons and/or an sshd in every node of a cluster that is
up, then one command (everything after ``--``: ``sbatch --wait job.sh``, ``salloc -N2 srun ...``,
``smp-adapter launch --hostfile hosts ...``) run in node 0 with the environment that reaches them
(SLURM_CONF; PATH with the tool's ssh, PDSH_RCMD_TYPE=ssh, PRTE_MCA_plm_ssh_agent), its output on this
terminal. The services are torn down after it, whatever happens. docs/cluster.md."""

from __future__ import annotations

import subprocess
from contextlib import ExitStack

import netns_slurm
import netns_sshd


def run_with_services(cluster, argv: list[str], slurm: bool, ssh: bool, timeout: float) -> int:
    """Start the services asked for, run ``argv`` in node 0 (bounded by ``timeout``), return its exit status."""
    with ExitStack() as stack:
        env: dict = {}
        if slurm:
            s = stack.enter_context(netns_slurm.SlurmCluster(cluster))
            env.update(s.env())
            print(f"netns_cluster: Slurm up: nodes {', '.join(s.node_names())} in partition smp, SLURM_CONF={s.conf}",
                  flush=True)
        if ssh:
            h = stack.enter_context(netns_sshd.SshCluster(cluster))
            env = h.env({**env, "PRTE_MCA_plm_ssh_agent": str(h.dir / "bin/ssh")})
            print(f"netns_cluster: sshd up in every node (n0..n{len(cluster.nodes) - 1}); ssh config {h.client_config}",
                  flush=True)
        proc = cluster.popen(0, argv, env=env, stdin=subprocess.DEVNULL)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            cluster._kill(proc)
            print(f"netns_cluster: {argv[0]} still running after {timeout:.0f} s: killed")
            return 124
