import sys

from tpcache.cli import main

sys.exit(main())
