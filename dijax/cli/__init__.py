"""The ``dijax`` command line: ``main`` (dijax.cli.main) and one module per subcommand."""
