"""Pages and figures read from run folders (through rundir/): the HTML report and its figures,
the population page, the tracr figure, the cross-run table. Never imports training/ or cli/."""
