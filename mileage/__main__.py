"""`python -m mileage` is the `mileage` command."""

import sys

from mileage.cli.main import main

sys.exit(main())
