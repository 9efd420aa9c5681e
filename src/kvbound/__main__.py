"""`python -m kvbound`: the `kvbound` command."""
import sys

from .cli import main

sys.exit(main())
