"""plan/zero3.py: ZeRO-3's gathers replayed by DeepSpeed's coordinator rules, on models small enough to
follow by hand. The prefetch bucket is 0 in the hand-derived cases (no prefetch: one call per module fetch
that finds its parameters released), the reuse distance 1 element (a parameter stays gathered only when
the very next module with parameters uses it) or DeepSpeed's default 1e9 (everything stays)."""

from dataclasses import replace
from types import SimpleNamespace

from smp_adapter.plan import zero3
from smp_adapter.plan.model_spec import ModelSpec

DEFAULT = 10**9
F, B = (zero3.FORWARD, zero3.PRIMARY), (zero3.BACKWARD, zero3.PRIMARY)


def spec(layers=1, layer=(100, 100), tied=False):
    """An embedding of 10 elements, ``layers`` layers of one module per tensor (each layer's own module
    around them), and, tied, a head reading the embedding again: zero3.default_trees, given as the
    spec's trees (a spec without trees is planned by depth, the last test)."""
    plain = ModelSpec("toy", layers, 8, 1, 8, 16, 4, tuple((n, False) for n in layer), ((10, False),),
                      tied_embeddings=tied)
    model, one_layer = zero3.default_trees(plain)
    return replace(plain, model_modules=model, layer_modules=one_layer)


def run(model, reach, checkpointing=False, hpz=False, bucket=0, reduce_bucket=150):
    dims = SimpleNamespace(tp=1, pp=1, cfg=SimpleNamespace(microbatches=1), hpz_partition_size=2 if hpz else 1)
    buffers = {"stage3_max_reuse_distance": reach, "stage3_max_live_parameters": DEFAULT,
               "stage3_prefetch_bucket_size": bucket, "reduce_bucket_size": reduce_bucket}
    job = SimpleNamespace(activation_checkpointing=checkpointing, accumulation=1)
    return zero3.gathers(model, dims, job, buffers, lambda n: False)


def test_nothing_is_released_at_the_default_reuse_distance():
    # every module's next use lies within 1e9 elements: the forward gathers the embedding (10) and the
    # layer's two modules (100 each), one call each, and the backward finds them all gathered
    out = run(spec(), DEFAULT)
    assert out.counts == {F: [3, 210]}
    assert out.peak == 210
    # so does a checkpointed job: its recompute finds them gathered too
    assert run(spec(), DEFAULT, checkpointing=True).counts == {F: [3, 210]}


def test_a_short_reuse_distance_releases_what_is_not_used_next():
    # trace: model, emb, layer, a, b | model, layer, b, a, emb (backward). emb and a are released after
    # their forward (the next module with parameters is another); b is kept (its backward is the next
    # use: model and layer hold no parameters); backward gathers a and emb again: 110 in 2 calls
    out = run(spec(), 1)
    assert out.counts == {F: [3, 210], B: [2, 110]}
    assert out.peak == 100  # one module at a time: a is released before b is gathered


def test_a_tied_weight_is_gathered_at_each_use_out_of_reach():
    # two layers of one 100-element module, the head reading emb again: forward emb 10, m0 100, m1 100
    # (m1 released: the head comes next), head 10 (emb again); the head's backward follows at once (kept
    # for it), then m1 100, m0 100 and emb 10 again: emb is gathered three times per step
    out = run(spec(layers=2, layer=(100,), tied=True), 1)
    assert out.counts == {F: [4, 220], B: [3, 210]}


def test_a_checkpointed_recompute_gathers_what_the_forward_released():
    # the layer's backward: its hook, b's backward fetch (b kept from the forward), then b's backward
    # needs the saved tensors: the recompute fetches a (released after the forward: gathered again, 100)
    # and b (still gathered), and releases both (each one's next module is the other); a's backward
    # gathers it a third time (100), emb's 10: backward 210 in 3 calls, 100 more than without
    out = run(spec(), 1, checkpointing=True)
    assert out.counts == {F: [3, 210], B: [3, 210]}


def test_hpz_reads_the_node_copy_after_a_parameter_s_first_gather():
    # the case above without checkpointing: the forward's gathers are each parameter's first in the
    # step (the primary partition over rdp); the backward's re-gathers read hpZ's secondary copy
    out = run(spec(), 1, hpz=True)
    assert out.counts == {F: [3, 210], (zero3.BACKWARD, zero3.SECONDARY): [2, 110]}


def test_prefetch_gathers_what_follows_in_one_call():
    # prefetch bucket 200, default reach: the model's own module is fetched first (no parameters), and
    # its prefetch takes emb, a and b from the queue (10 + 100 + 100 pass the bucket): one call for the
    # whole forward; bucket 100: emb and a (110), then b at a's fetch: 2
    assert run(spec(), DEFAULT, bucket=200).counts == {F: [1, 210]}
    assert run(spec(), DEFAULT, bucket=100).counts == {F: [2, 210]}


def test_reduce_scatter_calls_follow_the_bucket():
    # gradients in backward order b (100), a (100), emb (10), bucket 150: b; a would make 200, so b's
    # bucket is reduced (1) and a starts the next; emb joins it (110); the end reduces it (2)
    assert run(spec(), DEFAULT).reduce_calls == 2
    assert run(spec(), DEFAULT, reduce_bucket=1000).reduce_calls == 1


def test_without_module_trees_the_release_is_by_depth():
    # 210 gathered elements, reach 70: the last 35 stay gathered, 175 (5/6) are gathered again in backward;
    # one call per layer and one for the rest per pass; at the default reach nothing is released
    plain = replace(spec(), model_modules=(), layer_modules=())
    out = run(plain, 70)
    assert out.counts[F] == [2, 210] and out.counts[B] == [2, 175]
    assert run(plain, DEFAULT).counts[B] == [2, 0]
