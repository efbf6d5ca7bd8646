"""The ``dijax`` command: ``dijax generate | parity | convert`` (one module per subcommand in this package)."""

from __future__ import annotations

import argparse
import sys

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
from dijax.cli import USER_ERRORS, convert, describe_error, generate, parity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dijax", description="DeepSeek-V4.1-Flash inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline (default: the embedded tiny model)",
                       description=generate.__doc__.split("\n")[0])
    generate.add_arguments(g)
    g.set_defaults(run=generate.run)

    p = sub.add_parser("parity", help="check the model against a fixture of reference logits",
                       description=parity.__doc__.split("\n")[0])
    parity.add_arguments(p)
    p.set_defaults(run=parity.run)
    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint into dijax's format",
                       description=convert.__doc__.split("\n")[0])
    convert.add_arguments(c)
    c.set_defaults(run=convert.run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as error:
        print(f"dijax {args.command}: error: {describe_error(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
