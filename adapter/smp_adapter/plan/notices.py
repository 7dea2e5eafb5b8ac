"""What ``smp-adapter plan`` says beside its figures: every option it cannot model, named; a job that
leaves the GPU's tensor cores idle (fp32); groups that cross the network; host memory model creation
needs. One list of lines per plan, printed and put in --json as "notices".
"""

from __future__ import annotations

from smp_adapter.plan.layouts import spans_nodes

GiB = 2**30

# smp options that change memory or time in ways plan's formulas leave out: option -> (what plan
# assumes instead, when the option matters: a predicate over the config and the layout)
NOT_MODELLED = {
    "offload_activations": ("checkpointed activations are kept on the CPU: plan counts them in device memory and "
                            "leaves out the transfers", lambda cfg, dims: cfg.offload_activations),
    "activation_loading_horizon": ("the prefetch horizon of offloaded activations",
                                   lambda cfg, dims: cfg.offload_activations and "activation_loading_horizon" in cfg.given),
    "active_microbatches": ("a bound on the microbatches in flight: plan assumes the schedule's own (1F1B: p - i on "
                            "stage i)", lambda cfg, dims: "active_microbatches" in cfg.given and dims.pp > 1),
    "optimize": ("the pipeline partition's objective: plan assumes ceil(L / p) layers per stage",
                 lambda cfg, dims: "optimize" in cfg.given and dims.pp > 1),
    "memory_weight": ("the pipeline partition's objective: plan assumes ceil(L / p) layers per stage",
                      lambda cfg, dims: "memory_weight" in cfg.given and dims.pp > 1),
    "auto_partition": ("a manual partition (smp.partition): plan assumes ceil(L / p) layers per stage",
                       lambda cfg, dims: not cfg.auto_partition and dims.pp > 1),
}


def not_modelled(cfg, dims) -> list[str]:
    return [f"not modelled: {key} ({what})" for key, (what, applies) in NOT_MODELLED.items() if applies(cfg, dims)]


def precision_notice(cfg, cluster, precision: str) -> list[str]:
    """fp32 on a GPU whose 16-bit tensor cores are several times faster: said, with the fix."""
    fp32, half = cluster.flops.get("fp32"), cluster.flops.get("bf16") or cluster.flops.get("fp16")
    if precision != "fp32" or not fp32 or not half or half < 4 * fp32 or cluster.name == "custom":
        return []
    option = "bf16" if cluster.flops.get("bf16") else "fp16"
    return [f"precision: the job trains in fp32 (no fp16/bf16 option): the {cluster.gpu or 'GPU'}'s fp32 peak is "
            f"{fp32 / 1e12:.1f} TFLOP/s against {half / 1e12:.0f} TFLOP/s in {option} on its tensor cores, and every "
            f"tensor takes twice the memory; add \"{option}\": true to the smp options"]


def group_notices(dims, cluster) -> list[str]:
    out = []
    if dims.tp > 1 and spans_nodes(dims.grid.tp_group(0), cluster.gpus_per_node):
        out.append(f"tensor-parallel groups of {dims.tp} span nodes ({cluster.gpus_per_node} GPUs per node): every "
                   "layer's exchanges cross the network; keep tensor_parallel_degree <= the GPUs of a node")
    if dims.hpz_partition_size > 1 and spans_nodes(dims.grid.sdp_groups(dims.sdp)[0], cluster.gpus_per_node):
        out.append(f"hpZ groups of {dims.sdp} span nodes: the secondary copy's gathers cross the network, which hpZ "
                   f"exists to avoid; use a sharded_data_parallel_degree that divides {cluster.gpus_per_node}")
    if dims.mics_group_size > 1 and spans_nodes(dims.grid.sdp_groups(dims.sdp)[0], cluster.gpus_per_node):
        out.append(f"MiCS groups of {dims.sdp} span nodes: every parameter gather and gradient reduce-scatter crosses "
                   "the network, not only the replicas' gradient all-reduce; a sharded_data_parallel_degree that "
                   f"divides {cluster.gpus_per_node} keeps them inside a node")
    return out


def host_notice(plan, cluster) -> list[str]:
    """Host memory per node while the model is created (costs.host_bytes), against the node's."""
    host = plan.host
    if not host:
        return []
    ranks = cluster.gpus_per_node
    need = host["with_delayed_init" if host["delayed_init"] else "without_delayed_init"] * ranks
    line = (f"host memory at model creation: {need / GiB:,.1f} GiB per node ({ranks} ranks x "
            f"{need / ranks / GiB:,.1f} GiB, fp32, {'with' if host['delayed_init'] else 'without'} delayed parameter "
            "initialisation")
    if not cluster.host_memory:
        return [line + ")"]
    line += f"; the node has {cluster.host_memory / GiB:,.0f} GiB)"
    if need <= 0.9 * cluster.host_memory:
        return [line]
    fix = ("; set \"delayed_parameter_initialization\": true (then "
           f"{host['with_delayed_init'] * ranks / GiB:,.1f} GiB per node)") if not host["delayed_init"] else ""
    return [f"{line}: does NOT fit{fix}"]


def notices(plan, dims, cluster, precision: str) -> list[str]:
    return (precision_notice(dims.cfg, cluster, precision) + group_notices(dims, cluster) + not_modelled(dims.cfg, dims)
            + list(dims.cfg.warnings) + host_notice(plan, cluster))
