import sys

from phasewatch.trainers.cli import main

sys.exit(main())
