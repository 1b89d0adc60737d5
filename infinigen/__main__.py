from infinigen.cli import app

app(prog_name="infinigen")
