import sys

from dijax.cli.main import main

sys.exit(main())
