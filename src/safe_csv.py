"""The CSV files the tools write (predict's predictions.csv and submission.csv, prepare's
train.csv): safe to open in a spreadsheet, and read back row for row by any CSV reader.

- Formulas: a spreadsheet (Excel, LibreOffice Calc, Google Sheets) evaluates a cell that starts
  with = + - @, a tab or a carriage return, quoted or not: a file named `=HYPERLINK(...).jpg`
  would become a link. As OWASP's "CSV Injection" page advises, such a cell gets a single quote
  in front, which makes it text. A cell that starts with a single quote gets one too, so that
  every cell reads back the same way: drop one leading quote (original()).
- Rows: a cell holding a comma, a double quote, a line feed or a carriage return is quoted
  (RFC 4180, its quotes doubled). Python's csv module with "\\n" line ends leaves a lone carriage
  return unquoted (Python 3.11), which csv.reader and pandas then read as a line break: one
  file's prediction would be given to another name.
"""
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def neutralised(cell: str) -> str:
    """The cell as written: with a ' in front if a spreadsheet would take it for a formula (or
    it starts with ' itself)."""
    return "'" + cell if cell.startswith(FORMULA_STARTS + ("'",)) else cell


def original(cell: str) -> str:
    """A cell of these files as it was before neutralised(): one leading ' dropped."""
    return cell[1:] if cell.startswith("'") else cell


def _quoted(cell: str) -> str:
    if any(char in cell for char in ',"\r\n'):
        return '"' + cell.replace('"', '""') + '"'
    return cell


def csv_text(header: list[str], rows) -> str:
    """The CSV of `rows` (iterables of cells, each written as str()) under `header`, "\\n" line
    ends, every cell neutralised and quoted where it must be."""
    return "".join(",".join(_quoted(neutralised(str(cell))) for cell in row) + "\n" for row in [header, *rows])
