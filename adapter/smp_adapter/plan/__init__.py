"""smp-adapter plan: memory, communication and step time of a layout on a cluster (docs/plan.md)."""
