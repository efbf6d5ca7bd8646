import sys

from dijax.cli import main

sys.exit(main())
