"""`python eval.py ckpt_path=...`: see configs/eval.yaml. The code lives in src/project/eval.py."""

from project.eval import main

if __name__ == "__main__":
    main()
