"""Drop-in call signatures of existing trainers, built on the packloss engine."""
