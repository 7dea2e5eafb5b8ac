"""`from_pretrained` into MiCS shards (issue 61 item 3; scripts/mics_from_pretrained.py): at sdp 2 of 4 ranks
each rank's shards bit-equal its rows of the weights one process loads, from safetensors and from a `.bin`,
with every parameter read from the file by pread and none broadcast; a weight written after loading is not
the file's any more and arrives from dp rank 0 (x2 on every rank stays x2; x(1 + dp rank) becomes x1); the
full `resume_from_checkpoint` into a wrapped model of other weights reads each rank's rows from the mapped
checkpoint and ends with the same shards; the first loss of the whole batch equals plain PyTorch's (1e-5: the same model on the same rows, the mean over
replicas summed in another order), and three SGD steps of 2 microbatches then follow plain PyTorch's
losses with a unit per projection of each block, with and without activation checkpointing. Memory is benchmarks/kernel_memory.py's (`--models gpt2_pretrained`)."""

from launch_util import ROOT, run_ranks


def test_from_pretrained_reads_each_ranks_rows_into_its_mics_shards(tmp_path):
    results = run_ranks(ROOT / "tests/distributed/scripts/mics_from_pretrained.py", 4, out_dir=tmp_path, timeout=400)
    for rank, result in enumerate(results):
        for case in ("safetensors", "bin", "written", "full_resume"):
            run = result[case]
            assert run["engine"] == "MicsEngine", (rank, case, run)
            assert run["unequal"] == [], (rank, case, run)
            assert abs(run["loss"] - run["reference_loss"]) < 1e-5, (rank, case, run)
        assert result["safetensors"]["counts"] == {"file": 28, "broadcast": 0}, result["safetensors"]
        assert result["bin"]["counts"] == {"file": 28, "broadcast": 0}, result["bin"]
        # the resume maps the full checkpoint: every state-dict entry's rows read from it (29: the tied
        # embedding and head are two entries of one shard), none broadcast
        assert result["full_resume"]["counts"] == {"file": 29, "broadcast": 0}, result["full_resume"]
        # trained: a wide block's units (attention, the MLP's two projections, the block's norms) x 2 + the
        # root; the per-step losses equal plain PyTorch's (1e-5 relative: sums over replicas in another order)
        for case in ("safetensors", "bin"):  # bin: activation checkpointing on every block
            trained = result[case]
            assert trained["units"] == 9, trained
            for got, want in zip(trained["losses"], trained["reference_losses"], strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (case, trained)
        written = result["written"]["counts"]
        # the two written weights, and any neighbour sharing a written page of the mapping, are broadcast
        assert written["broadcast"] >= 2 and written["file"] + written["broadcast"] == 28, written
