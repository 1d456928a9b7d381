import sys

from rsd_bench.methods.cli import main

sys.exit(main())
