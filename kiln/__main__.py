"""`python -m kiln` runs the CLI."""
import sys

from kiln.cli.main import main

sys.exit(main())
