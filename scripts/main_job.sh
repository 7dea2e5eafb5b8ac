#!/usr/bin/env bash
# The main job: set up .venv, then train a tiny GPT-2 (created from its config) with sharded data parallel (ZeRO-3) on 2
# CPU processes through the deepspeed launcher, and write the report. Extra arguments go to
# `smp-adapter launch` (e.g. --hp steps=100 passes --steps 100 to the training script).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/smp-adapter launch --recipe recipes/causal_lm/gpt2_sdp.yaml "$@"
.venv/bin/smp-adapter report runs/gpt2_sdp
echo
echo "Hugging Face checkpoint: runs/gpt2_sdp/hf_model  (AutoModelForCausalLM.from_pretrained loads it)"
echo "Partial checkpoints:     runs/gpt2_sdp/checkpoints"
echo "Plot:                    runs/gpt2_sdp/report.png"
