import sys

from rsd_cli import main

sys.exit(main())
