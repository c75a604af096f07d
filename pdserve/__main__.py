import faulthandler
import signal
import sys

from pdserve.entrypoints.cli import main

# SIGUSR1 prints every thread's stack to stderr: how an operator (or a test) sees where a
# process that will not stop is waiting, without a debugger.
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.exit(main())
