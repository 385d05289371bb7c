"""What the tests share and are not tests themselves: the multi-rank launcher (``harness``), the models, data and
references of the parity tests (``*_cases``, imported by the ranks too), and the scripts some tests start as
programs of their own under ``torchrun`` or in a namespace (``*_script.py``, ``clean_install_steps.py``)."""
