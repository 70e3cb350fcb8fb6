"""`python -m mariner.loadtest.gpu_check`: the GPU checklist (`checklist.main`)."""

import sys

from mariner.loadtest.gpu_check.checklist import main

sys.exit(main())
