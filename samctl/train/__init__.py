"""Trainers users run through `samctl train ...`: EAGLE heads (eagle), SDSAT fine-tunes (sdsat),
SpecDec++ acceptance heads (acc_head), and the one writer of a model's own answers they share
(answers). Each trainer module has frozen settings (recorded in what it writes), `run(config)`, and
`main(argv)`, its command (an option per field) that `samctl train NAME` hands its arguments to."""
