"""What scripts written against other people's libraries expect: NVIDIA apex's names
(apex_fallback/, fused_optimizers.py), CUDA calls on CPU ranks (cuda_on_cpu.py), transformers'
Trainer under smp (hf_transformers.py), and which modules count as a library's (libraries.py).
No import here: the apex fallback is installed before torch is."""
