"""`python -m project.doctor`."""

from project.doctor import main

main()
