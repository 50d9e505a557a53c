"""Copy a code-edit set (tools/make_code_edit_set.py) adding each item's `prediction`: the code block
of its first turn, the text an edit mostly keeps (what adaptive drafts from with --input)."""
import json
import re
import sys

source, target = sys.argv[1:3]
with open(source) as inp, open(target, "w") as out:
    for record in map(json.loads, inp):
        code = re.search(r"```python\n(.*?)```", record["turns"][0], re.S)
        out.write(json.dumps({**record, "prediction": code.group(1) if code else ""}) + "\n")
