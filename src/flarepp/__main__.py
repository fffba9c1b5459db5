import sys

from flarepp.cli import main

sys.exit(main())
