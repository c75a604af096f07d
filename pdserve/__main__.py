import sys

from pdserve.entrypoints.cli import main

sys.exit(main())
