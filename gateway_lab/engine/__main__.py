import sys

from gateway_lab.engine.cli import main

sys.exit(main())
