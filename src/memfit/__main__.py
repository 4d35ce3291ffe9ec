from memfit.cli import main
import sys
sys.exit(main())
