import sys

from fuselane.cli import main

sys.exit(main())
