"""`python train.py [overrides]`: see configs/train.yaml. The code lives in src/project/train.py."""

from project.train import main

if __name__ == "__main__":
    main()
