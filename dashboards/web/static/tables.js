// Sorts a table.sortable by the column whose title is clicked (again: the other way).
// Cells sort by their data-value when they have one (numbers; empty = no figure, always
// last), else by their text. No data is fetched: the server rendered every row.
(function () {
  "use strict";

  function key(cell, numeric) {
    if (!cell) { return null; }
    var raw = cell.hasAttribute("data-value") ? cell.getAttribute("data-value") : cell.textContent.trim();
    if (!numeric) { return raw.toLowerCase(); }
    if (raw === "") { return null; }
    var n = Number(raw);
    return isNaN(n) ? null : n;
  }

  function sortBy(table, th, index) {
    var numeric = th.getAttribute("data-sort") === "number";
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var keyed = rows.map(function (row, i) { return { row: row, i: i, k: key(row.cells[index], numeric) }; });
    keyed.sort(function (a, b) {
      if (a.k === b.k) { return a.i - b.i; }  // stable: ties keep their order
      if (a.k === null) { return 1; }
      if (b.k === null) { return -1; }
      var order = a.k < b.k ? -1 : 1;
      return ascending ? order : -order;
    });
    keyed.forEach(function (x) { body.appendChild(x.row); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (cell) { cell.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
  }

  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, index) {
      if (!th.hasAttribute("data-sort")) { return; }
      th.classList.add("sort-handle");
      th.tabIndex = 0;
      th.addEventListener("click", function () { sortBy(table, th, index); });
      th.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortBy(table, th, index); }
      });
    });
  });
}());
