"""The communication ledger: record.py writes each rank's collectives and point-to-point traffic
(installed by ``smp.init`` when SMP_ADAPTER_COMM_LEDGER is set); summary.py reads it back for
``smp-adapter report``."""
