import sys

from extproc.engine.cli import main

sys.exit(main())
