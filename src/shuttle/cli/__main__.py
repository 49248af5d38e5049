import sys

from shuttle.cli import main

sys.exit(main())
