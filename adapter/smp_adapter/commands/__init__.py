"""``smp-adapter`` subcommands: one module per subcommand, each with ``add_parser(subparsers)``
and ``run(args) -> int``. cli.COMMANDS lists them."""
