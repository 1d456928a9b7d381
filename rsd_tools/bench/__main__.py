import sys

from rsd_tools.bench.cli import main

sys.exit(main())
