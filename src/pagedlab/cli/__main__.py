import sys

from pagedlab.cli.main import main

sys.exit(main())
