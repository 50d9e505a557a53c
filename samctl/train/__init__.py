"""Trainers users run through `samctl train ...`: EAGLE heads (eagle), SDSAT fine-tunes (sdsat),
SpecDec++ acceptance heads (acc_head), and the one writer of a model's own answers they share
(answers). Each trainer module has `main(argv)`, an argparse command line that `samctl train NAME`
hands its arguments to."""
